"""Fast int8 kernels for x86 CPUs: packed weights, fixed tensorized TIR schedules (VNNI or AVX2; dense and conv on AMX tiles where the target has them)."""

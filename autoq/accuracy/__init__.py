"""accuracy"""

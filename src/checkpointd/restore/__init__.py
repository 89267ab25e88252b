"""restore"""

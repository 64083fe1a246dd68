"""parsat.backend"""

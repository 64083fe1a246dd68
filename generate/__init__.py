"""parsat.generate"""

"""parsat.ir"""

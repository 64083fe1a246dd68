"""parsat.saturate"""

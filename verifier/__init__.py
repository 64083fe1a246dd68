"""parsat.verifier"""

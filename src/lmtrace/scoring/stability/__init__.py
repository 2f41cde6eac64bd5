"""Will this token flip: the stability ledger (ledger.py: the reference teacher-forced and decoded
under each variant) and its arithmetic over plain numbers (noise.py: margin, sigma, risk)."""

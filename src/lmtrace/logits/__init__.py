"""Pure math over logits, no model and no cache: the sampling processors, the one rule for a
token's numbers (measure.py), teacher forcing's records, the sampling waterfall."""

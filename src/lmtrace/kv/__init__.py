"""The KV cache: ledger.py (the only reader of transformers' cache internals: shapes, bytes,
rows), size.py (the formula a cache's bytes are checked against), rows.py (a row's own part)."""

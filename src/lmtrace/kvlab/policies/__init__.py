"""The KV-cache lab's policies: one module each (base.Policy says what a policy decides), named in
kvlab/spec.py's POLICIES."""

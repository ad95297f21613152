"""Configuration: typed schemas (schema.py), composition (compose.py), rules (validate.py)."""

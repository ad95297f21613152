"""A stand-in for a user's own package in the tests: factories, models and entry functions
that are importable as tests.usercode.<module>, right and wrong."""

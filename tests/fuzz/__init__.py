"""Fuzzing weightstore's readers: the entry points and mutations that ``tests/test_fuzz.py``
(a short seeded run) and ``./tasks fuzz`` (coverage-guided, atheris) share."""

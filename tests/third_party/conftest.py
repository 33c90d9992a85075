# Third-party test programs, vendored unmodified: pytest never collects them
# here (Mooncake's test_import_structure.py would otherwise run in-process).
# tests/test_mooncake_own_tests.py runs them as subprocesses.
collect_ignore_glob = ["*"]

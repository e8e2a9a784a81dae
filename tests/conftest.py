"""Shared test settings."""

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the [test] extra brings it; without it the property tests are skipped
    pass
else:
    # Deterministic property tests: the same examples on every run, nothing stored between runs.
    settings.register_profile("megacli", derandomize=True, database=None, deadline=None, max_examples=60,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile("megacli")

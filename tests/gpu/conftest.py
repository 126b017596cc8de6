"""The GPU tier's tests take pytest-timeout's ``timeout`` mark where one test needs more than the
tier's per-test limit; without the plugin (CPU machines) the mark is registered here so that it is
known, and has no effect."""


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit for this test (not installed here)")

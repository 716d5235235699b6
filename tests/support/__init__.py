"""What the tests share, in one place: the stand-ins (apiserver: the Kubernetes API, its
parts in api*.py, managedfields and resourceapi; registry_server: a real docker-registry
run for a test), host builders (hostkit), the official CDI schema (cdischema), the Helm
chart rendered (chartkit), and the repository's paths and the REQUIRE_INTEGRATION switch
(paths).

Importable from every test directory as ``support.<module>`` (pyproject's
``[tool.pytest.ini_options] pythonpath = ["tests"]``).
"""

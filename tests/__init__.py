"""The test suite. A package, so test modules and spawned ranks import the helpers as
``tests.helpers.<module>`` (pytest puts the repository root on sys.path: ``pythonpath``)."""

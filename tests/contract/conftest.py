"""The ``device`` parameter: every test (or module-scoped fixture) that takes ``device`` runs
once per device, ``cpu`` always and ``cuda`` (marked ``gpu``) where CUDA and the extension
exist; ``@pytest.mark.devices("cpu")`` limits a test to the devices it names. Rules for GPU
layouts (one GPU per rank, or CUDA MPS): tests/helpers/devices.py."""

from tests.helpers import devices


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(*names): run only on these devices")


def pytest_generate_tests(metafunc):
    if "device" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("devices")
    names = marker.args if marker else devices.DEVICES
    # module scope: a module-scoped world fixture that takes ``device`` runs once per device
    metafunc.parametrize("device", [devices.param(n) for n in names], scope="module")

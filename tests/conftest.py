import pytest


@pytest.fixture(scope="session", autouse=True)
def _structlog_configured():
    """The library never configures structlog (an application does): the tests run with the
    production default that the demo and benchmarks set, INFO to stderr."""
    from runtime.trace import configure_logging

    configure_logging()


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run long soak/property tests")


def pytest_collection_modifyitems(config, items):
    import torch

    skip_slow = pytest.mark.skip(reason="slow: needs --runslow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)

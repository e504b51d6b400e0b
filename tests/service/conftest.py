"""Ray + Serve once for the whole tests/service package (starting them costs seconds on 2 cores); each
module deploys its own app on it and deletes it afterwards."""
import pytest

from _cluster import start_cluster, stop_cluster


@pytest.fixture(scope="package")
def cluster():
    c = start_cluster()
    yield c
    stop_cluster()

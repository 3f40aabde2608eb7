import sys
from pathlib import Path

import pytest
import torch

# Tests are grouped like the package (ops/, models/, scheduling/, decoding/, methods/, cli/);
# the shared helpers (spec_helpers.py) and each group's modules stay importable by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every op test runs on each device present; CUDA cases skip without a GPU."""
    return torch.device(request.param)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and a spinning thread pool
    crawls when the machine is busy; the setting is restored for other modules.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

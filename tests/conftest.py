import os
import sys
import warnings
from pathlib import Path


os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


#: the tests are in folders by kind (unit, equivalence, integration, tools, cuda); a test module may import another's
#: helpers by name, whichever folder it is in
for folder in sorted(Path(__file__).parent.iterdir()):
    if folder.is_dir() and not folder.name.startswith(("_", ".")):
        sys.path.insert(0, str(folder))

datasets.disable_progress_bars()
datasets.disable_caching()
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    from trl_prefix_sharing.testing import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def load_script():
    """`load_script(name)`: the module of `scripts/<name>.py`, loaded from its file (the scripts are no package)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(autouse=True, scope="module")
def fresh_compilations():
    """Every test file starts from nothing compiled: shapes one file's FlexAttention runs made dynamic would make the
    next file's compile dynamic too, which hits a torch bug in the CPU FlexAttention kernel (a C++ compile error)."""
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def preferred_kernel_timer():
    """The suite's clock for `"auto"`: the preferred kernel (SDPA on the CPU) wins whatever this machine's timing, and
    the timed call is not run (tests of the measurement itself, `tests/unit/test_tuning.py`, inject clocks that run
    it)."""
    from trl_prefix_sharing import tuning
    from trl_prefix_sharing.testing import PreferredKernelTimer

    old = tuning.set_timer(PreferredKernelTimer())
    yield
    tuning.set_timer(old)

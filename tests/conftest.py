import os
import warnings


os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


datasets.disable_progress_bars()
datasets.disable_caching()
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    from trl_prefix_sharing.testing import make_tokenizer

    return make_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def fresh_compilations():
    """Every test file starts from nothing compiled: shapes one file's FlexAttention runs made dynamic would make the
    next file's compile dynamic too, which hits a torch bug in the CPU FlexAttention kernel (a C++ compile error)."""
    yield
    torch._dynamo.reset()


class PreferredKernelTimer:
    """The suite's clock for `"auto"`'s start-up measurement (`trl_prefix_sharing.tuning`): the kernel `"auto"`
    prefers on the device is the fastest, then the others in that order, stock rows the slowest, so a test sees the
    layouts of the preferred kernel (SDPA on the CPU) whatever this machine's timing. The timed call is not run
    (tests of the measurement itself, `tests/test_tuning.py`, inject clocks that run it)."""

    def measure(self, name, run, device):
        from trl_prefix_sharing.attention import _auto_candidates

        order = _auto_candidates(device)
        return 1.0 + order.index(name) if name in order else 10.0


@pytest.fixture(autouse=True)
def preferred_kernel_timer():
    from trl_prefix_sharing import tuning

    old = tuning.set_timer(PreferredKernelTimer())
    yield
    tuning.set_timer(old)

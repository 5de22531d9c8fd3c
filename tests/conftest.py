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

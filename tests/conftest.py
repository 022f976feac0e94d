"""Shared fixtures: tiny random Hugging Face checkpoints and the embedded SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (read when kernels are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Parallel test workers (pytest-xdist) share the cores: one compute thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Tiny shapes that still exercise GQA (4 query heads over 2 KV heads) and several layers.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
            # A wider init than the default 0.02 gives peaked logits, so greedy choices
            # are not decided by rounding noise.
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    # Layers 0 and 2 route each token to 2 of 8 experts; layer 1 stays dense.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
        norm_topk_prob=True)),
    # Sliding (8) and full layers, attention sinks, YaRN, and a biased top-2-of-8 mixture
    # with the clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", dict(
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8, rope_parameters={
            "rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64,
            "rope_theta": 150000.0})),
    # Local layers with an 8-token window around one global layer, two RoPE bases, and
    # a query scale other than head_dim ** -0.5.
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                       "sliding_attention"],
        query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}


def make_tiny_hf(family: str, path) -> "torch.nn.Module":
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases start at zero; make them count (Qwen2's q/k/v bias)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif family == "gemma3" and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # Gemma's norms scale by 1 + w, and w starts at 0
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """family -> (directory, transformers model) for every tiny family, built lazily."""
    built: dict = {}

    def get(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            built[family] = (path, make_tiny_hf(family, path))
        return built[family]

    return get


@pytest.fixture(scope="session")
def smollm():
    from vegas_core import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm_path():
    from vegas_core.loading.embedded import embedded_path

    return embedded_path("smollm2-135m")


# .ci/run sets this: there, a PostgreSQL test that cannot find the server fails, so CI
# can never pass by skipping it.
REQUIRE_POSTGRES_ENV = "VEGAS_TEST_REQUIRE_POSTGRES"


def _postgres_bin() -> "Path | None":
    import glob
    import shutil
    from pathlib import Path

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    path = found[-1] if found else shutil.which("initdb")
    return Path(path).parent if path else None


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server in a temporary folder for the session (Debian's
    postgresql package; as the ``postgres`` user when the tests run as root, since
    PostgreSQL refuses to run as root), and the URL of an empty database in it."""
    import shutil
    import socket
    import subprocess
    import tempfile
    from pathlib import Path

    bin_dir = _postgres_bin()
    if bin_dir is None:
        why = ("PostgreSQL's server binaries (initdb, pg_ctl) are not installed; "
               "scripts/setup-test-services.sh installs Debian's postgresql")
        if os.environ.get(REQUIRE_POSTGRES_ENV):
            pytest.fail(why)
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="vegas-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, log = root / "data", root / "server.log"

    def run(*args: str) -> None:
        subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)

    run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "start", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off")
    try:
        run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
            "vegas")
        yield f"postgresql://postgres@127.0.0.1:{port}/vegas"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                        "stop"], capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)

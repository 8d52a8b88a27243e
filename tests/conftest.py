import os

os.environ.setdefault("DLM_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests exercise the CPU kernels wherever they build (their speed choice at attach is tested on its own, in
# tests/test_cpu_kernels.py); DLM_CPU_ISA=generic (or avx2) runs them on a non-native instruction set.
os.environ.setdefault("DLM_CPU_KERNEL", "1")
# Training runs in fp32 whatever the CPU (bf16 autocast where it is faster is tested on its own, in
# tests/test_precision.py), so that a test's numbers do not depend on whether the machine has AMX.
os.environ.setdefault("DLM_CPU_BF16", "0")

import pytest  # noqa: E402

try:  # property tests (hypothesis): few examples by default, many under HYPOTHESIS_PROFILE=ci
    from hypothesis import HealthCheck, settings

    _hc = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
    settings.register_profile(
        "fast", max_examples=12, deadline=None, derandomize=True, suppress_health_check=_hc, print_blob=True
    )
    settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=_hc, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))
except ImportError:  # pragma: no cover - the property tests skip themselves
    pass

# an optional larger set of real benchmark slices beside a developer's checkout (tests/task_data.py writes the
# small files every other test reads)
REAL_DATA = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    """A `--data-dir` folder with every task's files in the real releases' layouts (tests/task_data.py)."""
    from task_data import write_task_data

    return str(write_task_data(tmp_path_factory.mktemp("task_data")))


@pytest.fixture(scope="session")
def real_data():
    if not os.path.isdir(REAL_DATA):
        pytest.skip(f"the optional real benchmark slices are not at {REAL_DATA}")
    return REAL_DATA


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from dlm.testing import make_tokenizer

    return make_tokenizer()


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A factory: tiny_model_dir(arch='llama', **config) -> folder with a tiny random model + tokenizer."""
    from dlm.testing import save_tiny

    def make(arch="llama", **kw):
        return save_tiny(tmp_path / f"tiny-{arch}", arch=arch, **kw)

    return make


@pytest.fixture(scope="session")
def smollm2_path():
    """The real embedded default model folder (slow tests only)."""
    from dlm.model.hub import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: thread synchronisation costs more than it saves."""
    import warnings

    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_built():
    """Build the decoding engine's CPU kernels once, up front (about a minute on a fresh machine; cached after),
    rather than inside whichever test - or server subprocess - first decodes."""
    from dlm.decode import cpu

    return cpu.extension()

"""hpnlp: fast neural NLP in JAX/Flax. `pip install -e .[test]`, then `pytest`."""
import setuptools

# Exact pins: JAX, Flax, optax and orbax change fast, and checkpoints that resume
# exactly need the same numerics on every machine. Bump together, then rerun tests.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "ml-collections==1.1.0",
    "absl-py==2.5.1",
    "chex==0.1.92",
    "numpy>=2.0,<3",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboardX==2.6.5",
    "psutil>=5.9",
    "ml-dtypes>=0.5",  # bfloat16's numpy dtype (hpnlp/retrieval/base.py; jax brings it too)
    # data: subword tokenizers (hpnlp/data/tokenizers.py) and prepared on-disk shards read
    # through grain (hpnlp/data/sharded.py, prepare.py)
    "sentencepiece==0.2.3",
    "grain==0.2.18",
    "array-record==0.8.6",
]

EXTRAS = {
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",
        "hypothesis>=6.100",
        "nbformat>=5.9",
        "nbclient>=0.10",
        "ipykernel>=6.29",
        "scipy>=1.11",
        # the vMF tests' float64 Bessel reference where scipy's ive underflows (a review: the
        # whole file was skipped where nothing else had brought mpmath in)
        "mpmath>=1.3",
        # the retrieval adapters' tests (faiss flat equals exact, save/load round trips)
        "faiss-cpu==1.15.1",
        "scann==1.4.2",
    ],
    # similarity search libraries behind hpnlp.retrieval's adapters (faiss_*, scann)
    "retrieval": ["faiss-cpu==1.15.1", "scann==1.4.2"],
    # torch 2.13.0 is the CPU build that this machine's image ships; a looser pin would
    # pull several GB of CUDA wheels.
    "bench": ["torch==2.13.0"],
}

setuptools.setup(
    name="hpnlp",
    version="0.1.0",
    description="High-performance NLP in JAX/Flax: efficient attention, approximate softmaxes, parallel training.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["hpnlp", "hpnlp.*"]),
    package_data={"hpnlp.data": ["corpus/*.xz"], "hpnlp.rnn": ["*.cc"],
                  "hpnlp.attention": ["*.cc", "*.json"],
                  "hpnlp.compress": ["*.cc"], "hpnlp.retrieval": ["*.cc"],
                  "hpnlp.kernels": ["*.h", "*.cc"]},
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)

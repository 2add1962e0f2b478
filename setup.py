"""Packaging: the top-level kernels/ and schemas/ ship inside the package as data."""
from setuptools import setup

setup(
    name="ort-trainer",
    version="0.1.0",
    description="ORTTrainer for today's PyTorch: one ONNX Runtime training graph, flat buffers, fused optimizers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=["ort_trainer", "ort_trainer.amp", "ort_trainer.data", "ort_trainer.optim", "ort_trainer.ortmodule",
              # the private stages (DESIGN.md, "Stages")
              "ort_trainer._configuration", "ort_trainer._export", "ort_trainer._graph", "ort_trainer._runtime",
              "ort_trainer._optimizers", "ort_trainer._compile", "ort_trainer._trainer",
              "ort_trainer.kernels", "ort_trainer.schemas"],
    package_dir={"ort_trainer.kernels": "kernels", "ort_trainer.schemas": "schemas"},
    package_data={"ort_trainer.kernels": ["*.cu", "*.cuh"], "ort_trainer.schemas": ["*.yaml"]},
    install_requires=["torch", "onnx", "cerberus>=1.3", "numpy", "pyyaml"],
    extras_require={
        "cpu": ["onnxruntime-training-cpu==1.19.2"],
        "gpu": [
            "onnxruntime-training==1.19.2",
            "cupy-cuda11x",
            "nvidia-cuda-runtime-cu11",
            "nvidia-cublas-cu11",
            "nvidia-cudnn-cu11==8.9.*",
            "nvidia-cufft-cu11",
            "nvidia-curand-cu11",
            "nvidia-cuda-nvrtc-cu11",
        ],
        # transformers 4.57.1 accepts torch 2.13.0 as installed (no newer torch pulled in).
        # accelerate: transformers.Trainer's PyTorch backend (examples/gpt2 --engine hf-trainer).
        # mypy: the type check of the stage boundaries (mypy.ini), as .ci/run runs it.
        "test": ["pytest", "tqdm", "transformers==4.57.1", "accelerate==1.11.0", "h5py", "peft==0.17.1",
                 "mypy==1.18.2"],
        # Resuming from the original ORTTrainer's HDF5 checkpoints.
        "legacy": ["h5py"],
        # matplotlib: --compare's picture; mlflow-skinny: --mlflow (logging to a local store, no server).
        "examples": ["tqdm", "transformers==4.57.1", "accelerate==1.11.0", "matplotlib>=3.7", "mlflow-skinny>=2.10"],
    },
)

"""semzo: semantic sharding and zeroth-order fine-tuning of transformers over MPI."""

__version__ = "0.1.0"

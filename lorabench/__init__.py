"""lorabench: a workbench for GRPO with LoRA and live adapter hot-swap into a rollout engine."""
__version__ = "0.1.0"

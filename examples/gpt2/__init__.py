"""The seed's GPT-2 fine-tuning with ORTTrainer (``run_lm_gpt2.sh``), beside the plain PyTorch loop."""

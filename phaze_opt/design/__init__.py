"""Evaluating one design (an accelerator and a training recipe): below the study drivers."""

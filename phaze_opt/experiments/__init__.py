"""Experiments that run studies (the published comparison, convergence): above the study drivers."""

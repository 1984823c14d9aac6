"""Sharded layers: tensor-parallel linears, vocabulary-parallel embedding and LM head."""

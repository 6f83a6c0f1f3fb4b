"""Collective algorithms: pure Python compositions of kernel calls over a workspace."""

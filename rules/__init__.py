"""Per-op gradient rules, one module per op family.

Every module registers its rules with :func:`gradbuilder.compiler.registry.register`; the registry
imports all modules of this package on first use.
"""

"""The compiler: trace a model on the meta device into a LayerGraph, and emit a plan's stage artifacts.

Modules: ``trace`` (trace(ModelSpec) -> LayerGraph), ``models`` (architecture from a local dir / HF
cache), ``emit`` (emit(plan, out_dir)), ``pictures`` (placement, schedule and simulate PNGs;
one module per picture over ``picture_style``).
"""

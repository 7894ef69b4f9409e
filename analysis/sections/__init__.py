"""One function per section of REPORT.md, one module per kind of experiment: each reduces the runs,
writes the section's tables and figure, and returns its Markdown plus the paper's claims it checks
(`section.py`: the Section and Claim types and the one verdict rule they all follow)."""
from .ablation import ablation_section, block_size_section, noise_section, tuned_lr_section
from .architecture import arch_section
from .curves import curves_section
from .depth import depth_section, dynamics_section
from .full import full_section
from .probe import multihop_section
from .robustness import robustness_section
from .scaling import scaling_section
from .section import Claim, Section, held_after_holm

__all__ = ["Claim", "Section", "ablation_section", "arch_section", "block_size_section",
           "curves_section", "depth_section", "dynamics_section", "full_section", "held_after_holm",
           "multihop_section",
           "noise_section", "robustness_section", "scaling_section", "tuned_lr_section"]

"""The ZO optimizer: seeded in-place perturbations, the step and its parallel modes
(:mod:`.engine`), the block-streamed schedule (:mod:`.streamed`), host offload (:mod:`.offload`),
the passes over the parameters (:mod:`.perturb`) and their CPU and GPU kernels (:mod:`.kernels`,
:mod:`.zgen`, :mod:`.kernels_gpu`). It knows no task: a task is anything with the stage protocol
of :class:`semzo.tasks.base.Task`."""

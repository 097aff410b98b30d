"""The erf GELU's rational approximation, shared by the CPU kernels (:mod:`.kernels`) and the
CUDA source of the GPU kernels (:mod:`.kernels_gpu`), which pastes the same float32 constants.

Rational approximation of erf on [-4, 4] (odd numerator / even denominator in x^2), the one
Eigen uses for float32; |error| < 5e-7 over the real line (erf is +-1 in float32 beyond 4).
"""

ERF_A = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
         -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
         -1.60960333262415e-02)
ERF_B = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
         -7.37332916720468e-03, -1.42647390514189e-02)

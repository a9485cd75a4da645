"""Admission: the validating webhook that checks ResourceClaims and ResourceClaimTemplates for
gpuslice's DeviceClasses (``validate``), the mutating webhook that turns other GPU-sharing
systems' pod specs into DRA claims (``mutate``, ``translate``, ``dialects``, ``selectors``), the
AdmissionReview envelope both answer through (``review``) and the ResourceSlice cache they
read (``inventory``)."""

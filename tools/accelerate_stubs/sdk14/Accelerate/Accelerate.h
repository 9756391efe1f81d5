// Stand-in for the part of <Accelerate/Accelerate.h> that csrc/cpu/accelerate_threads.h needs, as
// an SDK before macOS 15 declares it (no <vecLib/thread_api.h>): tests/test_blas_threads.py only.
#pragma once

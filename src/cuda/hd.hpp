// EPMOE_HD marks functions compiled for both the host and the device (the shared definitions that
// keep CPU references and GPU kernels bit-identical).
#pragma once

#ifndef EPMOE_HD
#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__
#else
#define EPMOE_HD
#endif
#endif

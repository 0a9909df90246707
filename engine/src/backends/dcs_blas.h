/*
 * dcs_blas.h -- the one place the engine names its BLAS.
 *
 * The CPU backend calls standard CBLAS (cblas_sgemm) and two OpenBLAS
 * extras (openblas_set_num_threads, openblas_get_corename / _get_config).
 * Built against PyPI's scipy-openblas32 (DCLENS_BLAS=scipy, the default;
 * CMake defines DCS_BLAS_SCIPY), every symbol of that library carries the
 * prefix scipy_, so that it never clashes with another BLAS in the process
 * (numpy's, SciPy's, the system's): the names are mapped here, once. Built
 * against the system's libopenblas (DCLENS_BLAS=system) they are the plain
 * names.
 */
#ifndef DCS_BLAS_H
#define DCS_BLAS_H

#include <cblas.h> /* the wheel's (scipy_-prefixed declarations) or the system's */

#ifdef DCS_BLAS_SCIPY
#define cblas_sgemm scipy_cblas_sgemm
#define openblas_set_num_threads scipy_openblas_set_num_threads
#define openblas_get_corename scipy_openblas_get_corename
#define openblas_get_config scipy_openblas_get_config
#define DCS_BLAS_NAME "scipy-openblas32"
#else
#define DCS_BLAS_NAME "system libopenblas"
#endif

#endif

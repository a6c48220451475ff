/* launch_cuda.c -- host launch code of the devices that run the CUDA C of
 * jit/print_cuda.c (cuda-sim and cuda): grid and
 * block sizing (ej_cuda_launch_dims), the per-access strides and the
 * packing of a kernel's argument struct.
 *
 * Argument struct of kernel i (print_cuda.c): struct ej_kargs_i { const T
 * *in0; ...; T *out<n_in>; ...; long long st[max(1, n_acc * rank)]; } --
 * 8-byte pointers then 8-byte strides, no padding on LP64, packed here
 * byte for byte.  A cuda launch passes its address as the one kernel
 * parameter; cuda-sim passes it to the module's entry.
 */
#include "kir.h"

void ej_cuda_sched_maxima(const ej_schedule *s, size_t *args, int *n_in,
			  int *n_out)
{
	*args = 0;
	*n_in = *n_out = 0;
	for (int i = 0; i < s->n_kernels; i++) {
		const ej_kernel *k = s->kernels[i];
		size_t a = ej_cuda_args_size(k);
		*args = a > *args ? a : *args;
		*n_in = k->n_in > *n_in ? k->n_in : *n_in;
		*n_out = k->n_out > *n_out ? k->n_out : *n_out;
	}
}

size_t ej_cuda_args_size(const ej_kernel *k)
{
	size_t ns = (size_t)k->n_acc * (size_t)k->rank;
	return sizeof(uint64_t) *
	       ((size_t)(k->n_in + k->n_out) + (ns > 0 ? ns : 1));
}

void ej_cuda_launch_prepare(const ej_kernel *k, epj_tensor *const *in,
			    epj_tensor *const *out, void *buf,
			    ej_launch_out *outs, ej_launch *l)
{
	_Static_assert(sizeof(void *) == sizeof(uint64_t), "LP64 only");
	unsigned char *p = buf;
	int r = k->rank;
	for (int i = 0; i < k->n_in; i++) {
		EJ_ASSERT(in[i] && in[i]->ndim == k->in[i].ndim);
		void *d = ej_data(in[i]);
		memcpy(p, &d, sizeof d);
		p += sizeof d;
	}
	for (int o = 0; o < k->n_out; o++) {
		void *d = ej_data(out[o]);
		memcpy(p, &d, sizeof d);
		p += sizeof d;
		outs[o].ptr = d;
		outs[o].elem = epj_dtype_size(k->out[o].dtype);
		outs[o].bytes = (size_t)epj_tensor_numel(out[o]) * outs[o].elem;
	}
	size_t ns = (size_t)k->n_acc * (size_t)r;
	for (size_t i = 0; i < (ns > 0 ? ns : 1); i++)
		memset(p + i * sizeof(int64_t), 0, sizeof(int64_t));
	for (int a = 0; a < k->n_acc; a++) {
		const ej_kaccess *x = &k->acc[a];
		const epj_tensor *t = in[x->input];
		int64_t sa[EPJ_MAX_DIMS] = { 0 };
		for (int d = 0; d < t->ndim; d++)
			if (x->map[d] >= 0)
				sa[x->map[d]] += t->stride[d];
		memcpy(p + (size_t)a * (size_t)r * sizeof(int64_t), sa,
		       (size_t)r * sizeof(int64_t));
	}
	ej_cuda_launch_dims(k, l->grid, l->block);
	l->smem = 0;
	l->args = buf;
	l->args_size = ej_cuda_args_size(k);
	l->outs = outs;
	l->n_out = k->n_out;
}

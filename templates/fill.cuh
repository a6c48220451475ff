/* fill.cuh -- fills a buffer with one value: the FULL op (and zeroing) on
 * the CUDA devices.  `bits` holds the value's bit pattern in the low `elem`
 * bytes (1, 2, 4 or 8), so one kernel serves every dtype.
 */

extern "C" __global__ void ej_fill(const struct ej_fill_args a)
{
	long long stride = (long long)gridDim.x * blockDim.x;
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	     i < a.n; i += stride) {
		switch (a.elem) {
		case 1:
			((unsigned char *)a.out)[i] = (unsigned char)a.bits;
			break;
		case 2:
			((unsigned short *)a.out)[i] = (unsigned short)a.bits;
			break;
		case 4:
			((unsigned int *)a.out)[i] = (unsigned int)a.bits;
			break;
		default:
			((unsigned long long *)a.out)[i] = a.bits;
			break;
		}
	}
}

/* The kernel-only packed linear probe (README.md): the 32000 x 512 LM head, four copies
 * streamed cold, rows 1-4, each row checked bit-equal to the one-row result.
 * Build: cc -O3 -march=native -ffp-contract=off -std=gnu11 linear_probe.c \
 *        ../../../../kernels/native/cpu_kernels.c -I../../../../kernels/native -lm */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
void ms_pack_f32(const float *w, int64_t ws_n, int64_t ws_k, float *p, int64_t N, int64_t K);
void ms_linear_packed_f32(const float *x, int64_t xs, const float *p, float *out, int64_t os,
                          int64_t M, int64_t K, int64_t N);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int64_t N=32000,K=512,C=4; int64_t panels=(N+23)/24;
  float *w=malloc(N*K*4); for(int64_t i=0;i<N*K;i++)w[i]=((i*7919)%1000)/1000.f-.5f;
  float *P[4]; for(int c=0;c<C;c++){P[c]=malloc(panels*24*K*4); ms_pack_f32(w,K,1,P[c],N,K);}
  float x[4*512]; for(int i=0;i<4*512;i++)x[i]=(i%17)/17.f;
  float *o=malloc(4*N*4), *ref=malloc(4*N*4);
  for(int M=1;M<=4;M++){
    double best=1e9;
    for(int rep=0;rep<8;rep++){double t=now(); for(int c=0;c<C;c++) ms_linear_packed_f32(x,K,P[c],o,N,M,K,N); t=(now()-t)/C; if(t<best)best=t;}
    /* rows must match M=1 exactly */
    int same=1; for(int m=0;m<M;m++){ms_linear_packed_f32(x+m*K,K,P[0],ref,N,1,K,N); ms_linear_packed_f32(x,K,P[0],o,N,M,K,N); if(memcmp(ref,o+m*N,N*4))same=0;}
    printf("M=%d %.3f ms %.1f GB/s same=%d\n",M,best*1e3,N*K*4/best/1e9,same);
  }
}

/* The kernel-only decode attention probe (README.md): cold caches, 8 layers, random block
 * tables, the kernel against a plain read of the same blocks in the same order.
 * Build: cc -O3 -march=native -ffp-contract=off -std=gnu11 attn_probe.c \
 *        ../../../../kernels/native/cpu_kernels.c -I../../../../kernels/native -lm
 * Run: ./a.out BATCH [BLOCKS LAYERS CONTEXT] */
#include <stdlib.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>
int ms_paged_decode_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens,
                        float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t window);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  const int64_t bs=16,hkv=4,d=64,h=8; int64_t L=argc>3?atoi(argv[3]):8,nblk=argc>2?atoi(argv[2]):4096,ctx=argc>4?atoi(argv[4]):1500,nb=(ctx+bs-1)/bs;
  int B=argc>1?atoi(argv[1]):3;
  size_t per=(size_t)nblk*bs*hkv*d;
  float **K=malloc(L*sizeof(float*)),**V=malloc(L*sizeof(float*));
  for(int l=0;l<L;l++){K[l]=aligned_alloc(64,per*4);V[l]=aligned_alloc(64,per*4);
    for(size_t i=0;i<per;i++){K[l][i]=(float)((i*7919)%1000)/1000.f-.5f;V[l][i]=(float)((i*104729)%1000)/1000.f-.5f;}}
  int64_t *tab=malloc(B*nb*8),*lens=malloc(B*8);
  srand(1); int64_t *perm=malloc(nblk*8); for(int i=0;i<nblk;i++)perm[i]=i;
  for(int i=nblk-1;i>0;i--){int j=rand()%(i+1);int64_t t=perm[i];perm[i]=perm[j];perm[j]=t;}
  for(int b=0;b<B;b++){lens[b]=ctx;for(int i=0;i<nb;i++)tab[b*nb+i]=perm[b*nb+i];}
  float *q=malloc(B*h*d*4),*o=malloc(B*h*d*4); for(int i=0;i<B*h*d;i++)q[i]=(i%13)/13.f;
  /* a big buffer to evict between reps */
  size_t ev=64<<20; char*E=malloc(ev);
  double best=1e9, bestsum=1e9; volatile float sink=0;
  for(int rep=0;rep<15;rep++){
    for(size_t i=0;i<ev;i+=64)E[i]++;
    double t=now();
    for(int l=0;l<L;l++) ms_paged_decode_f32(q,h*d,K[l],V[l],tab,nb,lens,o,B,h,hkv,d,bs,0.125f,0);
    t=now()-t; if(t<best)best=t;
    for(size_t i=0;i<ev;i+=64)E[i]++;
    t=now();
    __m256 acc=_mm256_setzero_ps();
    for(int l=0;l<L;l++)for(int b=0;b<B;b++)for(int i=0;i<nb;i++){
      const float*kk=K[l]+tab[b*nb+i]*bs*hkv*d,*vv=V[l]+tab[b*nb+i]*bs*hkv*d;
      for(int j=0;j<bs*hkv*d;j+=8){acc=_mm256_add_ps(acc,_mm256_load_ps(kk+j));acc=_mm256_add_ps(acc,_mm256_load_ps(vv+j));}}
    float tmp[8];_mm256_storeu_ps(tmp,acc);sink+=tmp[0];
    t=now()-t; if(t<bestsum)bestsum=t;
  }
  double mb=(double)B*nb*bs*hkv*d*2*4*L/1e6;
  printf("B=%d attn %.2f ms %.1f GB/s | plain read %.2f ms %.1f GB/s\n",B,best*1e3,mb/best/1e3,bestsum*1e3,mb/bestsum/1e3);
}

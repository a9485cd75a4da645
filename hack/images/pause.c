/* The pod sandbox's pause process for gpuslice's local images (hack/images.sh), in the role of
 * registry.k8s.io/pause: it holds the pod's namespaces, exits 0 on SIGINT/SIGTERM and, as PID 1
 * of a shared PID namespace, reaps the zombies reparented to it. Built with gcc -static. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "3.10"

static void on_stop(int signo) {
  (void)signo;
  _exit(0);
}

static void on_child(int signo) {
  int saved = errno;
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

int main(int argc, char **argv) {
  if (argc == 2 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
    printf("pause %s (gpuslice)\n", VERSION);
    return 0;
  }
  if (getpid() != 1) {
    fprintf(stderr, "Warning: pause should be the first process\n");
  }
  struct sigaction stop = {.sa_handler = on_stop};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  sigemptyset(&stop.sa_mask);
  sigemptyset(&child.sa_mask);
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    perror("sigaction");
    return 1;
  }
  for (;;) {
    pause();
  }
  return 42; /* not reached */
}
